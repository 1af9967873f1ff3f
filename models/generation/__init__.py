"""Generation for the Kimi K2 target: DDTree speculative decoding and autoregressive decoding in
one device-resident, CUDA-graph-captured loop (``KimiK2ForCausalLM.generate``).

- :mod:`.session`: buffers, the step, graph capture and replay, prefill.
- :mod:`.sampling`: greedy / Gumbel-max token choice with transformers' logits processing.
- :mod:`.budget`: the ``tree_budget="auto"`` cost model.
- :mod:`.oracle`: a drafter that knows the target's greedy continuation (tests, benchmarks).
- :mod:`.generate`: the transformers-style ``generate`` (the mixin the model lists as a base).
"""
from .budget import AUTO_BUDGETS, BudgetPlanner, FixedBudget
from .generate import DDTreeGenerateOutput, DDTreeGenerationMixin
from .oracle import OracleDrafter
from .sampling import SamplingMode, SamplingParams, process_logits, select_tokens
from .session import GenerationSession

__all__ = ["DDTreeGenerationMixin", "DDTreeGenerateOutput", "GenerationSession", "OracleDrafter", "BudgetPlanner",
           "FixedBudget", "AUTO_BUDGETS", "SamplingMode", "SamplingParams", "process_logits", "select_tokens"]
