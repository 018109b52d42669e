"""The performance model behind `largebatch plan`: compute from model FLOPs and a device catalog,
communication from alpha-beta-gamma costs of five all-reduce algorithms on a two-level topology,
overlap with backward, and the time and money a training run takes.

`predict(...)` returns a `Prediction` dataclass; see `largebatch.perf.model` for the equations.
"""
from largebatch.perf.model import ALGORITHMS, Prediction, allreduce_time, predict

__all__ = ["ALGORITHMS", "Prediction", "allreduce_time", "predict"]
