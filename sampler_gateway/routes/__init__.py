"""Thin routes per protocol: parse only what routing needs (an id, a timeout, an affinity key),
call `forward.to_new`/`to_owner`, rewrite the ids that name a replica, pass the rest through."""
