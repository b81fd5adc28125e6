"""The file layer shared by :mod:`accel.weights` and :mod:`accel.checkpoint` (private to
accel): safetensors streaming with CRC32s, parallel writers, atomic replaces, which ranks write,
argument checks, safe and bounded reads of untrusted input, torch zip/pickle screening, and
the type checks of restored values.
"""

__all__: list[str] = []  # the modules are imported on their own
