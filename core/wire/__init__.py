"""The pool <-> worker wire: the framed messages (``protocol``) and the spec a worker is started
with (``spec``). Below the pool, the API, the worker and conversations; imports only errors,
sampling, state and the config schema (never llama.cpp)."""
