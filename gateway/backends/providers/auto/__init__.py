"""`model: "auto"`: a small, torch-free complexity classifier (features.py, classifier.py,
weights.json fit by fit.py on data/router_eval's train split) and the chooser (chooser.py)
that sends each request to the cheapest model whose capability rank is enough."""

from gateway.backends.providers.auto.chooser import AutoChoice, AutoPolicy, AutoRouter, choose
from gateway.backends.providers.auto.classifier import Classifier, Prediction

__all__ = ["AutoChoice", "AutoPolicy", "AutoRouter", "Classifier", "Prediction", "choose"]
