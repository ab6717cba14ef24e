"""The worker process: one per model, started by the pool.

    python -m timeshare.core.worker --spec JSON --ipc-fd N

JSON = {"model": {ModelConfig fields}, "arena": {ArenaConfig fields}, "arena_dir": str | null,
"kv_dir": str, "event_log": str | null}. The worker speaks core/protocol.py over the socket
``N``; it logs to stderr and never writes to stdout.

Threads:
- the **loop thread** owns the Engine (the llama objects), the residency and the conversations;
  every request, release and restore runs there;
- the **reader thread** decodes frames from the pool and enqueues them (StatusRequest, the
  watchdog's ping, too: the loop thread answers it, so a hung loop thread is seen), and answers
  undecodable frames with ``Error(code="protocol")`` (or ends the session when the stream cannot
  be resynced);
- the **warden thread** (arena) only enqueues a "yield" task when another worker rings;
- the main thread waits, and turns SIGTERM/SIGINT into a Shutdown task.
"""
