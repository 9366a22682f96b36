"""Speculative decoding: proposers of draft tokens and the policy deciding how many to verify.

The engine asks the proposer for drafts before scheduling, verifies them inside the step's ragged
batch (a decode becomes q_len = 1 + k), and the sampler decides losslessly which are accepted
(inferd.sampling.rejection). Nothing here decides acceptance.
"""

from inferd.spec.proposer import Proposer, build_proposer

__all__ = ["Proposer", "build_proposer"]
