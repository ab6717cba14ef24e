"""The pool: the supervisor of the model workers, in the app process (no Qt, no llama objects).

One worker process per configured model (``python -m timeshare.core.worker``), spawned with a clean
environment, talking ``core/wire/protocol.py`` over a socketpair. One **pool thread** owns every
piece of pool state (workers, request queues, timers); everyone else talks to it through its inbox:

- public methods (``generate``, ``pin``, ``sleep`` ...) post a call and wait for its answer;
- one reader thread per worker posts each message it reads, then the worker's exit;
- timers (restart backoff, idle release, stop escalation, the hung-holder watchdog's tick) run on
  the pool thread itself.

The hung-holder watchdog (``watchdog``): a worker of this pool that holds the GPU token, or heads
its queue, while another process waits, and answers no status ping for ``arena.hung_holder_s``
(a stopped or frozen process), is killed (SIGKILL to its process group) and restarted like a crash.

After every change the pool thread publishes a new frozen :class:`PoolSnapshot` (read by
``snapshot()`` from any thread) and queues a :class:`PoolEvent`; an event thread hands events to
subscribers, so a slow subscriber never stalls the workers' streams.

Modules: ``supervisor`` (:class:`Pool`, one class: its public methods, then the pool thread's
halves of them, then what the pool thread does by itself), ``actor`` (the inbox, timers and event
thread the Pool owns), ``record`` (one worker: process, request queue, its policy for crashes,
spawn retries and idle release, what a snapshot shows), ``lifecycle`` (a worker's states and the
transitions allowed between them), ``process`` (spawning, signalling, reaping, logs),
``generation`` (a caller's handle), ``configure`` and ``codes`` (a configuration's checks, a
worker's error codes as typed errors), ``devices`` (per-device status), ``watchdog`` (hung holders).
"""
