"""Drafter recipes (`--recipe`): which states a drafter family trains on, following SpecForge's
data preparation for each.

- eagle3: the EAGLE-3 auxiliary layers (SGLang's default for the model, e.g. [1, N/2-1, N-4]) plus the
  final state.
- dflash (also Domino): 5 target layers spread evenly over [1, N-3], no final state, and only samples
  with consecutive loss tokens (a run of at least `min_loss_run`).
- dspark: the dflash layers and sample rule, plus the final state (its L1 and confidence objectives).

Layer ids follow the same convention everywhere: id k is the output of decoder layer k, HF
`hidden_states[k+1]`; SpecForge's DFlash reads `hidden_states[k + 1]` for its target layer id k.
"""

from __future__ import annotations

from dataclasses import dataclass

# SpecForge's DFlash-family data preparation keeps a sample only if two adjacent tokens are in the loss:
# a draft block needs its anchor and at least one token to predict after it. (Its older releases asked
# for 2 x block size loss tokens in total; --min-loss-run raises the bar.)
MIN_DRAFT_LOSS_RUN = 2


@dataclass(frozen=True)
class Recipe:
    name: str
    num_aux_layers: int | None  # None: SGLang's EAGLE-3 default layers for the model
    keeps_final_state: bool  # whether the final state (hidden_states) is stored
    min_loss_run: int  # a sample needs this many consecutive loss tokens (0: no rule)

    def layer_ids(self, num_model_layers: int) -> tuple[int, ...] | None:
        """The layer ids to capture for a model of `num_model_layers` decoder layers (None: SGLang's)."""
        if self.num_aux_layers is None:
            return None
        return spread_layer_ids(num_model_layers, self.num_aux_layers)


RECIPES = {
    "eagle3": Recipe("eagle3", num_aux_layers=None, keeps_final_state=True, min_loss_run=0),
    "dflash": Recipe("dflash", num_aux_layers=5, keeps_final_state=False, min_loss_run=MIN_DRAFT_LOSS_RUN),
    "dspark": Recipe("dspark", num_aux_layers=5, keeps_final_state=True, min_loss_run=MIN_DRAFT_LOSS_RUN),
}


def spread_layer_ids(num_model_layers: int, count: int) -> tuple[int, ...]:
    """`count` layer ids spread evenly from 1 to N-3 (one alone: the middle layer), rounded half to
    even as DFlash's own layer choice rounds, so a drafter configured by layer count finds the same ids
    (Qwen3-8B, 36 layers: 1, 9, 17, 25, 33)."""
    if count == 1:
        return (num_model_layers // 2,)
    span = num_model_layers - 4
    ids = tuple(round(1 + i * span / (count - 1)) for i in range(count))
    if len(set(ids)) != count:
        raise ValueError(
            f"a model of {num_model_layers} decoder layers is too shallow for {count} distinct layers spread "
            f"over 1..{num_model_layers - 3} (got {list(ids)}); pass --layers"
        )
    return ids
