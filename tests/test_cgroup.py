"""Container ids from /proc/<pid>/cgroup, over one fixture per runtime, driver and cgroup version."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpuscope.host.cgroup import container_id_from_cgroup, read_container_id

FIXTURES = Path(__file__).parent / "fixtures" / "cgroup"

# The made-up ids used in the fixtures (sha256 of a label, see fixtures/cgroup/README.md).
DOCKER_ID = "d548c5b83fa61d8e3bd86ad42a7ffea9b7c86e3f9d8095c1577d3e1270bb9420"
K8S_ID = "17c132990e8e8523ccd403287b6ae761c1cd57f764df278bce7ed310bbddd7f1"
CRIO_ID = "c64064614423cb790e88b3e5492ff5ccf673b25ae823089f7a60c65cda24d809"
PODMAN_ID = "2f259bab93aaaaa2542ba43ef33eb990d0999ee1b9924b557b7be53c0b7a1bb9"
DIND_OUTER_ID = "560e3e12b1e0dafa161e62fb3327ad65c98b7cd53849b17c627e8d3e1d419d6a"
DIND_INNER_ID = "33bf6fbd7cd8379785a21e233d8e09f824e7bab459168a96312c1c882c1d7e1f"
KIND_NODE_ID = "23e60658111a240b11962ea4c36d8545c06271103792d48d4fe82c2f9c3bc3ba"
KIND_POD_ID = "0e10f4c893c58ffbcd950ab74e6b4ae8a7ebcf257897a02739254906984c6074"

EXPECTED: dict[str, str | None] = {
    # docker
    "docker_cgroupfs_v1.txt": DOCKER_ID,
    # hybrid: the unified 0:: line still says containerd.service; the v1 lines win.
    "docker_cgroupfs_hybrid.txt": DOCKER_ID,
    "docker_systemd_v1.txt": DOCKER_ID,
    "docker_cgroupfs_v2.txt": DOCKER_ID,
    "docker_systemd_v2.txt": DOCKER_ID,
    "docker_rootless_systemd_v2.txt": DOCKER_ID,
    # Kubernetes: dockershim, containerd, cri-o
    "k8s_docker_systemd_v1.txt": K8S_ID,
    "k8s_containerd_cgroupfs_v1.txt": K8S_ID,
    "k8s_containerd_systemd_v1.txt": K8S_ID,
    "k8s_containerd_systemd_v2.txt": K8S_ID,
    "k8s_containerd_cgroupfs_v2_guaranteed.txt": K8S_ID,
    "k8s_containerd_static_pod_cgroupfs_v2.txt": K8S_ID,
    # the agent in its own cgroup namespace sees other pods above its root
    "k8s_containerd_foreign_cgroupns_v2.txt": K8S_ID,
    "k8s_crio_systemd_v2.txt": CRIO_ID,
    "k8s_crio_systemd_v1.txt": CRIO_ID,
    "k8s_crio_cgroupfs_v1.txt": CRIO_ID,
    "k8s_crio_conmon_v2.txt": None,
    # podman
    "podman_systemd_v2.txt": PODMAN_ID,
    "podman_rootless_systemd_v2.txt": PODMAN_ID,
    "podman_cgroupfs_v1.txt": PODMAN_ID,
    "podman_conmon_v2.txt": None,
    # nesting: the innermost container is the workload's
    "dind_cgroupfs_v1.txt": DIND_INNER_ID,
    "dind_systemd_v2.txt": DIND_INNER_ID,
    "dind_undelegated_controllers_v1.txt": DIND_INNER_ID,
    "kind_pod_systemd_v2.txt": KIND_POD_ID,
    "kind_pod_cgroupfs_v1.txt": KIND_POD_ID,
    "kind_node_containerd_v2.txt": KIND_NODE_ID,
    # host processes
    "host_user_session_v2.txt": None,
    "host_sshd_v2.txt": None,
    "host_init_v2.txt": None,
    "host_root_v2.txt": None,
    "host_user_session_v1.txt": None,
    "host_containerd_daemon_v2.txt": None,
    # 64-hex strings where no runtime puts a container
    "lookalike_bare_hex_v2.txt": None,
    "lookalike_custom_parent_v1.txt": None,
    "lookalike_mount_unit_v2.txt": None,
    "lookalike_service_unit_v2.txt": None,
    "lookalike_short_id_v2.txt": None,
    "lookalike_uppercase_v2.txt": None,
    "lookalike_pod_without_kubepods_v2.txt": None,
}


def test_every_fixture_has_an_expectation() -> None:
    on_disk = {path.name for path in FIXTURES.glob("*.txt")}
    assert on_disk == set(EXPECTED)


@pytest.mark.parametrize(("fixture", "expected"), sorted(EXPECTED.items()))
def test_container_id_from_fixture(fixture: str, expected: str | None) -> None:
    assert container_id_from_cgroup((FIXTURES / fixture).read_text()) == expected


@pytest.mark.parametrize(("fixture", "expected"), sorted(EXPECTED.items()))
def test_read_container_id_from_procfs(tmp_path: Path, fixture: str, expected: str | None) -> None:
    (tmp_path / "4242").mkdir()
    (tmp_path / "4242" / "cgroup").write_bytes((FIXTURES / fixture).read_bytes())
    assert read_container_id(4242, procfs=tmp_path) == expected


@pytest.mark.parametrize(
    "text",
    [
        "",
        "\n\n",
        "garbage without colons\n",
        "0::\n",
        f"0:/docker/{DOCKER_ID}\n",  # two fields only: not a cgroup line
    ],
)
def test_malformed_content_is_none(text: str) -> None:
    assert container_id_from_cgroup(text) is None


def test_line_order_breaks_ties_between_equal_nesting() -> None:
    # Two lines that each name one (different) container: the first line in the file wins.
    text = f"1:name=systemd:/docker/{DOCKER_ID}\n0::/system.slice/docker-{K8S_ID}.scope\n"
    assert container_id_from_cgroup(text) == DOCKER_ID


def test_crlf_and_trailing_text_after_the_id_segment() -> None:
    text = f"0::/machine.slice/libpod-{PODMAN_ID}.scope/container/init\r\n"
    assert container_id_from_cgroup(text) == PODMAN_ID


def test_path_with_colons_is_kept_whole() -> None:
    # Only the first two colons separate fields; a colon later on belongs to the path.
    text = f"0::/odd:name/docker/{DOCKER_ID}\n"
    assert container_id_from_cgroup(text) == DOCKER_ID


def test_unreadable_file_is_none(tmp_path: Path) -> None:
    assert read_container_id(4242, procfs=tmp_path) is None  # no such pid directory


def test_non_utf8_content_does_not_raise(tmp_path: Path) -> None:
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "cgroup").write_bytes(b"0::/\xff\xfe/docker/" + DOCKER_ID.encode() + b"\n")
    assert read_container_id(7, procfs=tmp_path) == DOCKER_ID


def test_read_container_id_of_this_process_does_not_raise() -> None:
    # Whatever this test machine is, our own cgroup file is readable and parses to an id or None.
    result = read_container_id(os.getpid())
    assert result is None or len(result) == 64
