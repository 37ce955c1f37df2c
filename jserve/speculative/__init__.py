"""Speculative decoding (docs/speculative.md): proposers on the host offer draft tokens, the
scheduler fits them into the iteration as tokens, the step scores them as extra decode rows,
the sampler verifies them and ``SchedulerBase.update`` keeps the accepted prefix."""
from jserve.speculative.config import SpeculativeConfig
from jserve.speculative.ngram import propose_ngram

__all__ = ["SpeculativeConfig", "propose_ngram"]
