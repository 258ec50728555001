"""What the launcher and the rank worker agree on: the phases a job can run, and the progress-line marker.

Standard library only: the launcher (which never imports torch) reads it too.
"""

from __future__ import annotations

#: the phases of a job, in the order a job lists them (codegen.harness.worker.main)
PHASES = ("no-policy", "codegen", "compiled", "stock", "ab")
#: rank 0 prints `<PROGRESS><message>` lines; the launcher passes them on while the ranks run
PROGRESS = "@@codegen-progress "
#: what a job runs with unless the spec says otherwise (`decode_check`: the teacher-forced decode steps with the cache
#: whose logits the no-policy and codegen phases compare against the reference's)
DEFAULTS = dict(prompt_len=16, batch=2, generate=16, decode_steps=0, warmup=1, repeats=1, grad_check=False,
                tp_grain_size=0, decode_check=8, e2e_tokens=0, e2e_repeats=1)
