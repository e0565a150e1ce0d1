"""Temporary compatibility import: the shared flag groups moved to `dustin.flags`.

Kept only while dustin/serve/cli.py, dustin/eval/{fidelity,retrieval,tasks,arr_kl}.py and dustin/bench/serve.py
still import `dustin.cli.args`; delete this file once they import `dustin.flags` (tests/test_imports.py lists
them in its allow-list). Nothing new should import it.
"""
from dustin.flags import (  # noqa: F401 - re-exported for the modules named above
    SPARSE_CONFIG_HELP,
    add_model_args,
    add_sparse_args,
    add_speculation_args,
    check_sparse_config,
    int_list,
    method_list,
)
