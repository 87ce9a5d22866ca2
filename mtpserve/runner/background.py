"""Graphs built while steps run (compile_in_background, runner/graphs.py): where that can be, in what order."""
MANY = "many"   # the batch in the key of a CPU graph of any batch above FEW_ROWS rows


def compile_order(key: tuple) -> tuple:
    """Fused steps (a steady decode's every step) before the passes apart, fewer rows first, more drafts first
    (what adaptive k drafts at small batches on eager costs): main b1 q1, fused b1 q1, fused b1 q2, fused many q2
    -> fused b1 q2, fused b1 q1, fused many q2, main b1 q1."""
    which, size, q = key
    return which.kind != "fused", size == MANY, 0 if size == MANY else size, -q


def compile_later_refusal(device_type: str, world_size: int) -> str | None:
    """Why graphs cannot be built by a compiler thread while steps run (None: they can)."""
    if world_size > 1:
        return f"one process only ({world_size} ranks: their graphs run collectives in step)"
    if device_type != "cpu":
        return f"CPU only (device = {device_type!r}: CUDA graphs are captured at start-up)"
    return None
