"""jserve: a JAX/XLA serving stack for Llama-family models with preemptive scheduling."""
from jserve.engine.output import RequestOutput
from jserve.llm import LLM
from jserve.sampling.params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput"]
__version__ = "0.1.0"
