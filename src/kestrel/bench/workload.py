"""A benchmark's workload: how many requests, their prompt and output lengths, and the random
token ids every engine in one run is given."""

import random
from dataclasses import dataclass


@dataclass
class Workload:
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    random_lengths: bool = False
    seed: int = 0

    def prompts(self, vocab: int) -> list[list[int]]:
        """Random token ids; with random_lengths, prompt lengths uniform in [P/2, 3P/2]."""
        rng = random.Random(self.seed)
        lengths = [
            rng.randint(max(1, self.prompt_tokens // 2), self.prompt_tokens * 3 // 2)
            if self.random_lengths
            else self.prompt_tokens
            for _ in range(self.num_requests)
        ]
        return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]

    def outputs(self) -> list[int]:
        rng = random.Random(self.seed + 1)
        if not self.random_lengths:
            return [self.output_tokens] * self.num_requests
        o = self.output_tokens
        return [rng.randint(max(1, o // 2), o * 3 // 2) for _ in range(self.num_requests)]
