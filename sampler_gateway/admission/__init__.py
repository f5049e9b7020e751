"""Admission of new sampling work, fair across flows once the pool is full: the gate every new request
passes (`gate.py`), the deficit round robin that picks which waiting flow goes next (`fair_queue.py`),
and a submitted future's place, held until the future ends on its replica (`future_places.py`)."""
