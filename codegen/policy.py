"""The generated `autotp_policy.py`: rendered from the family table (the policy refactor makes it header + runtime)."""

from __future__ import annotations

from codegen.families import KNOB, Family
from codegen.render import render


def render_policy(family: Family, modeling_module: str) -> str:
    """The `autotp_policy.py` `patch` writes next to the patched `<modeling_module>.py`."""
    return render(
        "autotp_policy.py.j2",
        family=family.model_type,
        knob=KNOB,
        moe_classes=list(family.moe_classes),
        layout=_legacy_layout(family),
        modeling_module=modeling_module,
    )


def _legacy_layout(family: Family):
    """Transitional: the old template's view of the table (the policy refactor replaces the template)."""
    from types import SimpleNamespace

    down = family.per_expert.down
    return SimpleNamespace(
        replicated=tuple(f"mlp.{r}" for r in family.routers),
        routed_down=f"mlp.{family.experts_attr}.*.{down}",
        shared_down=tuple(f"mlp.{s}.{down}" for s in family.shared_experts),
        column=(),
        attention_replicated=tuple(f"self_attn.{a}" for a in family.attention_replicated),
    )
