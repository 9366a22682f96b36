"""Training the learned draft head (EAGLE-style) for a target model: data generation by
self-distillation, the training loop, offline acceptance and the draft vocabulary's ranking.

    python -m inferd.train.train_eagle --help

Nothing on the serving path (inferd.engine, inferd.server, inferd.spec) imports this package; it
imports theirs: the head itself (inferd.spec.eagle_head) and the engine that generates the data.
"""
