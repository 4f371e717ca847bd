"""Snapshots on the kubernetes backend: a fork and the container-only tests (the rest runs on local and docker)."""

import pytest

from container_snapshot import (  # noqa: F401
    test_a_restore_into_a_read_only_path_is_a_typed_error_naming_it,
    test_changes_anywhere_on_the_root_are_taken_and_the_image_is_not,
)
from test_sandbox_snapshot import test_a_fork_sees_the_prepared_files_and_no_later_change_of_its_base  # noqa: F401

pytestmark = [pytest.mark.k8s]
