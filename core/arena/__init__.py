"""The VRAM arena of one device: leases on its VRAM budget that worker processes take and give back.

A lease is what was once the single GPU token: a worker's weights are on the device iff it holds
one, and the leased bytes never exceed the device's budget (:mod:`.budget`: the setting, the fit
rule; :mod:`.leases`: the files). Under a one-model budget one lease at a time is exactly the old
token. Below, "the token" means a lease.

Layout of an arena directory (mode 0700, owned by the user, never reached through a symlink):

    token        the arena lock: ``flock``-ed for the short critical sections of :mod:`.leases`
    budget       the budget in force (its first member's); members hold a shared ``flock`` on it
    leases/      one lease file per holder: ``<pid>-<n>-<model>``, ``flock``-ed by it while it holds
    holder       JSON record of the most recent holder (model, pid, since, pinned)
    released     JSON record of the last release (model, pid, release_ms, at): written by the
                 releasing holder before its lease goes, taken (read and removed) by the next
                 grant, whose ``TokenGrant.previous_release_ms`` then says it
    seq          ticket counter, incremented under ``flock``
    waiters/     one ticket file per process that wants a lease: ``<seq>-<pid>-<model>`` (its bytes)
    device-N/    the arena of GPU N (N >= 1), laid out the same

Why tickets: ``flock`` is not FIFO (a holder may re-take the lock it just dropped) and dropping it
makes no inotify event. So a waiter takes a ticket (the counter is bumped and the ticket file is
created under the counter's lock, so ticket order is creation order); only the head of the queue
tries to fit, the others watch ``waiters/`` until every ticket ahead of theirs is gone. The head
takes its lease under the arena lock when its bytes fit, else blocks in ``flock`` on the lease of
the first holder it waits for (see :mod:`.client`), and removes its ticket once it holds a lease,
which lets the next one in.

Liveness: each ticket file is ``flock``-ed by its owner for as long as it waits (the lock is taken
on a temporary name before the file is renamed into ``waiters/``, so it is never seen unlocked).
A ticket whose lock anyone can take belongs to a dead process and is swept by whoever scans.
The kernel drops the token's lock when its holder dies, so a crash never wedges the arena; a
holder record whose pid is dead is ignored by :func:`read_holder`.

Hostile or broken entries (``Arena.sweep``, run when an :class:`Arena` opens and every
``SWEEP_INTERVAL_S`` by each waiter): only regular files are opened, never through a link and never
blocking (a FIFO is not opened for a writer). In ``waiters/`` anything that is not a live ticket
is removed when nothing can own it (an unlocked file, a symbolic link, a FIFO, an empty
directory) and otherwise ignored and reported by path (a directory with files in it). A ticket
counter that is not a number of at most 12 digits (negative, 20 digits, garbage) counts on after
the queue, and never falls behind it; a counter that is a link is replaced. ``.tmp`` leftovers of
dead pids are removed; a holder record that is not one (garbage, a link, out-of-range fields) or
whose pid is dead is removed while the token is free. A ``token`` that is not a regular file is
an :class:`ArenaError` naming it (it is never replaced: a process could still hold the GPU
through the file that name had before).

The doorbell: the holder watches ``waiters/`` (inotify IN_CREATE, IN_MOVED_TO, IN_DELETE,
IN_MOVED_FROM, IN_Q_OVERFLOW; a rescan right after adding the watch and every
``RESCAN_INTERVAL_S``) and rings a callback when another process waits, and again every
``RING_REPEAT_S`` for as long as anyone waits (level-triggered, so a dropped ring is not a lost
waiter). Where inotify does not exist (or cannot be set up) the same protocol runs by polling
the directory.

Threads: a :class:`TokenClient` waits for the token on a helper thread (the worker's loop thread
stays free for status and cancel) and watches the doorbell on a warden thread; both only call
back, they never touch anything of the worker's.
"""
