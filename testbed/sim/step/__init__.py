"""What one training step is made of, worked out once, and when each part may run: the step's facts
(:class:`~testbed.sim.step.facts.StepFacts`: per chunk the cost, each F/B/W action's work, its MoE
pieces, tensor collectives and spans of blocks, gradient bytes and buckets, the optimizer update) and
the step's timing rules (:mod:`~testbed.sim.step.step_rules`). Both tiers read it: the task graph
(testbed.sim.graph) builds tasks from it, the analytic tier (testbed.explore) plays it, so the two
cannot drift apart on what a step is.
"""
