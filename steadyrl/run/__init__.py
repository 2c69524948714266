"""What a run leaves on disk and reads back: the run folder and its view (`runfolder`,
`runview`), checkpoints (`checkpoint`, with `tensors`, `signing`, `shards`, `ckpt_writer`), the
policy versions the actors load (`policy_files`), the rollout cache, quarantined records,
exported models, and disk-space handling (`diskspace`)."""
