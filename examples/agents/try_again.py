"""A tiny multi-turn environment (docs/agents.md): the model answers, hears "wrong try again"
while its answer is not right, and answers again; an episode ends on a right answer or after
`rollout.agent.max_turns`. The run's reward function (e.g. `tiny_copy`) scores the final answer.

    steadyrl up --model tiny --env examples/agents/try_again.py:TryAgain --reward tiny_copy

Stateless: `step` reads only the messages and the row, so nothing needs serializing (a rollout
worker that dies between turns loses nothing: the next one rebuilds it from the messages)."""


class TryAgain:
    def reset(self, row):
        self.truth = row["ground_truth"] or ""
        return row["messages"]

    def step(self, messages):
        answer = messages[-1]["content"]
        if answer[:1] == self.truth[:1]:
            return [], 1.0, True
        return [{"role": "user", "content": "wrong try again"}], 0.0, False
