"""What goes over Kafka: the record contracts (`contracts`), their encoding (`codec`) and the
JSON schemas made from them (`schemas`). The topic catalogue is `steadyrl.bus.topics`."""
