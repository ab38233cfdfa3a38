"""Testing helpers shipped with the package: fork launcher, numeric checks, torch references."""

from .checks import assert_bitwise_equal, assert_close_ulp, outcome, ulp
from .launcher import RankFailure, launch

__all__ = ["launch", "RankFailure", "assert_bitwise_equal", "assert_close_ulp", "outcome", "ulp"]
