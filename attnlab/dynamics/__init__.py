"""Theory lab: training dynamics of attention (Scan and Snap, JoMA) on synthetic data.

Modules: ``scan_snap`` (sequence classes, Y/Z model), ``scan_snap_theory`` (theorem
checks), ``joma`` (joint MLP + attention, reduced v dynamics), ``hierarchy`` (latent
tree + small Transformer), ``plots``, ``experiments`` / ``experiments_joma`` (runnable
units), ``registry`` and ``cli`` (``attnlab dynamics <experiment>``).
"""
