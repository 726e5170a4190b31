"""``lmcache.v1.lookup_client.abstract_client.LookupClientInterface``."""

import abc


class LookupClientInterface(metaclass=abc.ABCMeta):
    @abc.abstractmethod
    def lookup(self, token_ids, lookup_id=None, request_configs=None): ...

    @abc.abstractmethod
    def close(self): ...
