"""The policy and what it is trained on: models and tokenizers (`models`), the prompt data and
its chat encoding (`data`), and the rewards: built-in scorers (`rewards`), the scorer kinds
(`scorers`), answer similarity and the process pool that scores (`scorepool`)."""
