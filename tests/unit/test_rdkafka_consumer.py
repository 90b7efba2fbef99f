"""The librdkafka client's pieces that need no broker: the shared client settings in librdkafka's names, and a topic
id in kafka-python's spelling (a lake written by one client must name its topic as the other reads it)."""

from __future__ import annotations

import uuid

import pytest

from flywheel.base.kafka import KafkaClientConfig
from flywheel.ingest.lake_writer import LakeWriterConfig
from flywheel.ingest.rdkafka_consumer import rdkafka_config, uuid_text


def test_security_settings_map_to_librdkafka_names() -> None:
    cfg = KafkaClientConfig(security_protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-512", sasl_username="u",
                            sasl_password="p", ssl_cafile="/ca.pem", client_id="team")
    assert rdkafka_config(cfg, "lake-writer-w1") == {
        "security.protocol": "sasl_ssl", "client.id": "team-lake-writer-w1", "sasl.mechanisms": "SCRAM-SHA-512",
        "sasl.username": "u", "sasl.password": "p", "ssl.ca.location": "/ca.pem"}
    assert rdkafka_config(KafkaClientConfig(), "x") == {"security.protocol": "plaintext", "client.id": "x"}


@pytest.mark.parametrize("value", [uuid.UUID("8f4e2b6c-1d3a-4f5e-9b7c-0a1b2c3d4e5f"), uuid.UUID(int=2**128 - 1),
                                   uuid.UUID(int=1), uuid.UUID(int=2**63)])
def test_a_topic_id_reads_as_kafka_python_spells_it(value: uuid.UUID) -> None:
    """confluent-kafka gives the id's two halves as Java longs (signed); kafka-python a uuid.UUID."""
    def signed(bits: int) -> int:
        return bits - 2**64 if bits >= 2**63 else bits

    class Uuid:  # confluent_kafka.Uuid's accessors
        def get_most_significant_bits(self) -> int:
            return signed(value.int >> 64)

        def get_least_significant_bits(self) -> int:
            return signed(value.int & (2**64 - 1))

    assert uuid_text(Uuid()) == str(value)


def test_the_zero_id_of_a_broker_without_ids_is_none() -> None:
    class Zero:
        def get_most_significant_bits(self) -> int:
            return 0

        def get_least_significant_bits(self) -> int:
            return 0

    assert uuid_text(Zero()) is None and uuid_text(None) is None


def test_the_writer_refuses_an_unknown_client() -> None:
    from flywheel.base.config import ConfigError

    with pytest.raises(ConfigError, match="kafka_client"):
        LakeWriterConfig(kafka_client="aiokafka").check()
    LakeWriterConfig(kafka_client="confluent").check()
