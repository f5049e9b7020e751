"""The hop to a replica: one HTTP exchange and what its failure means for a retry (`exchange.py`:
`NotStarted`, `Lost`, `TimedOut`, a relayed `Stream`), over the gateway's own HTTP/1.1 client
(`http1.py`: keep-alive connections, whole bodies or streamed ones)."""
