"""TRAIL output-length prediction: a small MLP over one layer's hidden state predicts how many
tokens a request still has to generate, refined across steps by a Bayesian filter."""
from jserve.probe.bins import LengthBins
from jserve.probe.length_probe import LengthProbe, default_probe_path, train_probe
from jserve.probe.smoothing import RemainingFilter, posterior, transition_matrix

__all__ = ["LengthBins", "LengthProbe", "default_probe_path", "train_probe", "RemainingFilter",
           "posterior", "transition_matrix"]
