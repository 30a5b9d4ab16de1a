"""lightning_par's Hydra plugins, found by Hydra through the ``hydra_plugins`` namespace package.

* ``hydra/launcher=lightning_par`` (:mod:`.launcher`): each sweep job runs as its own world of processes.
* A search-path plugin (:mod:`.searchpath`): lightning_par's config groups (``conf/``, shipped in the package as
  ``lightning_par.conf``) are found from any directory, so ``python -m lightning_par.train`` works after
  ``pip install``.

Hydra imports every module here whenever any Hydra app starts, so none of them imports torch or Lightning at module
level.
"""
