"""Every private torch / Lightning / OmegaConf / Hydra API that lightning_dcp touches, and every version gate.

When one of those projects moves a name, only a module here changes. Four modules, by who may import them:

- :mod:`~lightning_dcp._compat.torch_dcp`: torch and DCP privates (the engine, the tools and the front ends);
- :mod:`~lightning_dcp._compat.omegaconf_hydra`: OmegaConf and Hydra privates (the codec);
- :mod:`~lightning_dcp._compat.lightning_run`: Lightning names and run internals (the front ends only);
- :mod:`~lightning_dcp._compat.lightning_hooks`: the Lightning entry points :mod:`lightning_dcp.trainer.hooks`
  routes (the front ends only).

An import-linter contract (pyproject.toml) keeps the engine and the tools off the two Lightning modules.
"""
