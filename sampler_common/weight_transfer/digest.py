"""The sha256 digests of weights moved over the network, defined once for every side that computes them.

A trainer computes them while it sends, a replica while it receives (and compares), and later a peer
that serves a catch-up and the replica that verifies it. So the definition must not depend on how the
bytes travelled (chunking, order of sending, backend):

* **tensor digest**: sha256 of the tensor's bytes, C-contiguous, in the machine's native byte order
  (little-endian on every platform torch and vLLM run on). Nothing else: name, dtype and shape are
  checked separately, and enter the model digest below.
* **model digest** (`weights_sha256`): sha256 of a manifest, UTF-8, one line per tensor in order of
  name (Python's string order, i.e. by code point), each line
  ``<name> TAB <dtype> TAB <shape> TAB <tensor digest, 64 lowercase hex> LF``,
  where ``<dtype>`` is torch's dtype name without ``torch.`` (``bfloat16``, ``float32``: the names
  vLLM's update info carries as ``dtype_names``) and ``<shape>`` the dimensions joined by ``,``
  (empty for a scalar). Independent of the order the tensors were sent in, so two replicas that hold
  the same weights report the same digest whoever sent them. It is what `/health` reports for weights
  pushed over the network, and what a pool will declare (`spec.weights`) and a replica catching up
  from a peer will verify.

Names containing a tab or a line break are refused before anything is received (`is_plain_name`):
they would make the manifest ambiguous.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

DIGEST_BYTES = 32
_HEX64 = re.compile(r"[0-9a-f]{64}")


def is_hex_digest(value: object) -> bool:
    """A sha256 digest as 64 lowercase or uppercase hex characters."""
    return isinstance(value, str) and _HEX64.fullmatch(value.lower()) is not None


def is_plain_name(name: str) -> bool:
    return bool(name) and not any(c in name for c in "\t\n\r")


def tensor_sha256(data: bytes | bytearray | memoryview) -> bytes:
    """The raw 32-byte digest of one tensor's bytes (hashlib releases the GIL on large buffers)."""
    return hashlib.sha256(data).digest()


@dataclass(frozen=True)
class TensorRecord:
    """One line of the manifest: what the model digest covers of a tensor."""

    name: str
    dtype: str  # torch's name: "bfloat16"
    shape: tuple[int, ...]
    sha256: str  # the tensor digest, hex

    def line(self) -> str:
        return f"{self.name}\t{self.dtype}\t{','.join(str(d) for d in self.shape)}\t{self.sha256.lower()}\n"


def model_sha256(records: Iterable[TensorRecord]) -> str:
    """The model digest over `records`, in any order (hex)."""
    h = hashlib.sha256()
    for r in sorted(records, key=lambda r: r.name):
        h.update(r.line().encode())
    return h.hexdigest()


def records(names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]],
            digests: Sequence[bytes]) -> list[TensorRecord]:
    """Manifest records from the parallel lists vLLM's update info carries, and raw digests."""
    return [TensorRecord(n, d, tuple(s), h.hex()) for n, d, s, h in zip(names, dtypes, shapes, digests, strict=True)]
