"""A two-turn environment the tiny model learns in about two minutes (docs/agents.md): the model
guesses a hidden digit, the environment tells it the digit, and it answers again. Only the
environment's message holds the digit, and only the second answer is scored, so the reward
rises only as the model learns to read that message.

    steadyrl up --config configs/tiny.yaml --env examples/agents/guess.py:Guess

With `tiny_copy` rows (the prompt is one digit, the ground truth the same digit), `reset` hides
the digit behind "?"; `step` answers the first guess, right or wrong, with the digit four times
("7777": the tiny model finds four sooner than one among its guess's characters), and ends the
episode after the second answer, which the run's reward function scores. A lucky first guess
ends nothing: were it scored, the policy would learn to guess the commonest digits instead of
reading the environment.

Stateless: `step` reads only the messages and the row (the serialization contract)."""


class Guess:
    def reset(self, row):
        self.truth = row["ground_truth"] or ""
        return [{"role": "user", "content": "?"}]       # the digit is not in the first turn

    def step(self, messages):
        if sum(m["role"] == "assistant" for m in messages) == 1:
            return [{"role": "user", "content": self.truth * 4}], None, False   # told the digit
        right = messages[-1]["content"][:1] == self.truth[:1]
        return [], float(right), True                   # the second answer ends the episode
