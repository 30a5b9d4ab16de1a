"""Expert parallelism: the experts of each mixture-of-experts layer split over the ``ep`` ranks, tokens exchanged with
all-to-all (:mod:`~lightning_par.expert_parallel.dispatch`), registered as the ``ep`` axis
(:mod:`~lightning_par.expert_parallel.axis`)."""

from lightning_par.expert_parallel.dispatch import ExpertDispatch, all_to_all

__all__ = ["ExpertDispatch", "all_to_all"]
