from moe_plugins.core.rank_exit import exit_rank
from moe_plugins.tools.cli import main

exit_rank(main())     # a rank under torchrun (verify, profile) must not finalize: see moe_plugins.core.rank_exit
