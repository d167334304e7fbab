"""Attention anatomy: what attention looks like inside real models.

``anatomy`` measures sinks, entropy and heavy hitters per layer and head from the
engine's own attention probabilities; ``sinks`` runs the StreamingLLM
drop/replace/keep experiment; ``entropy_dynamics`` (J3) trains small models with
``attnlab.train`` and logs attention entropy, sink mass, MLP stable rank and
embedding cosines over training; ``plots`` draws all of it.
"""
