"""``ai-backend bench``, the load generator: ``cli`` (its arguments and exit status), ``drive``
(one run), ``loops`` (closed and open loop), ``senders`` (the request bodies and clients),
``summary`` (the report), ``target`` (the loopback URL) and ``usage`` (CPU and memory)."""
