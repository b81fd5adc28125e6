"""Checkpoints written by other libraries, read without running any of their pickles.

``load_state`` (and ``accel merge-weights`` / ``accel checkpoint inspect``) turn to these
readers when a directory holds no accel manifest:

* ``accelerate``: HuggingFace Accelerate's ``Accelerator.save_state`` directories, found and
  read into plain states;
* ``deepspeed_files``: the files of DeepSpeed's ``engine.save_checkpoint`` directories, checked
  and loaded with inert stand-ins for DeepSpeed's classes;
* ``deepspeed_params``: their partitions put back together per parameter (fp32 master weights,
  optimizer state).

They read directories and return states; putting a state into the live objects is
``load_state``'s part (:mod:`accel.checkpoint`): it imports these readers, and they import
none of its modules. The modules are imported on their own (each loads torch), so importing
this package is cheap.

Example:
    >>> from accel.checkpoint.foreign.accelerate import is_accelerate
    >>> is_accelerate(Path("acc_ckpt"))
    True
"""

from __future__ import annotations

__all__: list[str] = []  # the modules are imported on their own
