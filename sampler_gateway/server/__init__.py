"""The gateway as one of several behind one address: its socket when it shares a node's port
(`listen.py`, `--reuse-port`), and the header that names which gateway answered (`served_by.py`)."""
