"""The sampler server that runs in every sampler pod: FastAPI over a vLLM AsyncLLM engine."""

__version__ = "0.1.0"

import time

# When this process started serving code (the first module `python -m sampler_pod` runs): the start-up
# deadline (--startup-timeout-s, core/startup.py) counts from here, imports included.
STARTED_AT = time.monotonic()
