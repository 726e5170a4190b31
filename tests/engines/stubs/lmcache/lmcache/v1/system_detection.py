"""``lmcache.v1.system_detection.NUMADetector``: no NUMA mapping on a test host."""


class NUMADetector:
    @staticmethod
    def get_numa_mapping(config: object) -> None:
        return None
