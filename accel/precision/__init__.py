"""Mixed precision: autocast, the prepared forward's casts, FSDP's policy and the GradScaler
life, one unit per mode.
"""
