"""A request's life through the gateway (`forward.py`): new work picked, sent, and sent once more after
a lost replica or a stale answer; owned work (a future, a session) sent to the replica its id names.
New work for one adapter version lives the same life, placed by lora/router.py instead of the picker
(`adapter_forward.py`). `forward.Gateway` holds the services every route calls."""
