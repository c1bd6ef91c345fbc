"""SamplingParams lives in protocol.sampling (torch-free, shared with the node seam and other
engines); re-exported here so `engine.sampling_params.SamplingParams` keeps working."""

from protocol.sampling import GREEDY_EPSILON, Priority, SamplingParams

__all__ = ["GREEDY_EPSILON", "Priority", "SamplingParams"]
