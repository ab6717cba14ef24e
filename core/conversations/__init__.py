"""Conversations: the SQLite store of conversations and messages (``store``, the only writer of
the file) and the chat service that answers them through the pool (``chat``)."""
