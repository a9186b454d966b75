"""Numbers as people read them: byte counts, counts of things."""


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def plural(n: int, word: str, many: str | None = None) -> str:
    """'1 file', '2 files', '0 problems' (`many` for an irregular plural)."""
    return f"{n} {word if n == 1 else (many or word + 's')}"
