"""The autoscaler: sizes each pool of prefill and decode nodes and acts through one
`Actuator` (local processes, Kubernetes Deployments, or a written decision for KEDA).

It runs only in the leading coordinator (planner/loop.py checks the election every tick). The
decision code (planner/decide.py) is pure: it takes observations and a clock, so recorded load
traces replay it on a virtual clock (planner/trace.py) exactly as it runs live.
"""
