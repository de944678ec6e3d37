"""Byte sizes as people write them ("2GiB", "800MB", 123456789), read by the C++ core."""
from memfit._loader import load

_C = load()


def parse_budget(size, name="budget"):
    """Bytes from an int or a size text; ValueError naming `name` and what is accepted."""
    if isinstance(size, bool):
        raise ValueError(f"{name} {size!r}: expected bytes as an int or a size such as '2GiB' or '800MB'")
    if isinstance(size, int):
        value = size
    elif isinstance(size, float) and size.is_integer():
        value = int(size)
    elif isinstance(size, str):
        try:
            value = _C.parse_size(size)
        except ValueError as e:
            raise ValueError(f"{name} {size!r}: {e}") from None
    else:
        raise ValueError(f"{name} {size!r}: expected bytes as an int or a size such as '2GiB' or '800MB'")
    if value <= 0:
        raise ValueError(f"{name} {size!r}: expected a positive number of bytes")
    return value


def format_bytes(n):
    """'1.50 GiB', '12.3 MiB', '512 B'."""
    return _C.format_bytes(int(n))
