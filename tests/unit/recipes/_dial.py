"""Which leaves of two config dicts (``dataclasses.asdict``) differ, by dotted key."""


def leaves(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(leaves(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
    return out


def differing(a: dict, b: dict) -> set[str]:
    a, b = leaves(a), leaves(b)
    return {k for k in a if a[k] != b[k]}
