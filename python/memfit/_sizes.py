"""Byte sizes as people write them ("2GiB", "800MB", 123456789), read by the C++ core."""
from memfit._loader import load

_C = load()


def parse_budget(size, name="budget"):
    """Bytes from an int or a size text; ValueError naming `name` and what is accepted (the C++ rule)."""
    return _C.size_bytes(size, name)


def format_bytes(n):
    """'1.50 GiB', '12.3 MiB', '512 B'."""
    return _C.format_bytes(int(n))
