"""A small fictional world for `searchr1-mini`: a passage corpus and questions that need it.

Everything is made up from syllables with a seeded `random.Random`, so no model knows the answers without
searching, and the same seed always gives the same world (byte for byte in the JSONL files). With the
defaults: 12 countries, 48 cities, 160 people, 80 companies; 460 passages (one per place and company, two
per person); 940 questions: 540 single-hop (birthplace, profession, founder, founding year, capital,
country of a city), 320 with 2 hops (country of birth; birthplace of a company's founder; country of a
company's headquarters) and 80 with 3 hops (country of birth of a company's founder). A tenth of the
questions, chosen by the seed, form the `test` split (94); the rest are `train` (846).

`python -m asyncrl_agents.tasks.mini_world --out DIR` writes `corpus.jsonl`, `train.jsonl` and
`test.jsonl` to DIR.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from asyncrl_agents.jsonl import write_jsonl

GENERATOR_VERSION = 1
"""Bumped whenever the generator's output changes, so cached files of an older world are not reused."""

_ONSETS = ("b", "br", "d", "dr", "f", "g", "k", "kr", "l", "m", "n", "p", "r", "s", "t", "th", "v", "z")
_VOWELS = ("a", "e", "i", "o", "u", "ae", "ei", "ou")
_CODAS = ("", "", "n", "r", "l", "s", "th", "m", "x")
_PROFESSIONS = (
    "botanist", "cartographer", "composer", "engineer", "glassblower", "historian", "linguist", "painter",
    "physician", "sculptor", "astronomer", "architect", "chemist", "poet", "watchmaker", "economist",
)  # fmt: skip
_INDUSTRIES = (
    "shipping", "textile", "software", "mining", "brewing", "aviation", "publishing", "pharmaceutical",
    "robotics", "furniture", "telescope", "railway",
)  # fmt: skip
_AWARDS = ("Silver Quill", "Amber Compass", "Iron Lantern", "Golden Loom", "Azure Star", "Copper Key")
_RIVERS_PER_COUNTRY = 2


@dataclass(frozen=True, slots=True)
class Question:
    question_id: str
    question: str
    answers: tuple[str, ...]
    num_hops: int
    split: str
    support: tuple[str, ...]
    """Ids of the passages that together answer the question (for demonstrations and analysis)."""


@dataclass(frozen=True, slots=True)
class World:
    passages: list[dict[str, str]]
    """Corpus rows `{"id", "contents"}`, `contents` being `"Title"\\ntext` as Search-R1 corpora write it."""
    questions: list[Question]

    def split(self, name: str) -> list[Question]:
        return [question for question in self.questions if question.split == name]


class _Names:
    """Unique made-up names: one to three syllables, capitalised."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng
        self._used: set[str] = set()

    def word(self, min_syllables: int, max_syllables: int) -> str:
        while True:
            syllables = self._rng.randint(min_syllables, max_syllables)
            parts = [
                self._rng.choice(_ONSETS) + self._rng.choice(_VOWELS) + self._rng.choice(_CODAS)
                for _ in range(syllables)
            ]
            name = "".join(parts).capitalize()
            if name not in self._used and len(name) >= 4:
                self._used.add(name)
                return name


def generate(
    seed: int = 0,
    *,
    num_countries: int = 12,
    cities_per_country: int = 4,
    num_people: int = 160,
    num_companies: int = 80,
    test_fraction: float = 0.1,
) -> World:
    """Build the world of `seed` in memory (a few milliseconds)."""
    rng = random.Random(seed)
    names = _Names(rng)
    passages: list[dict[str, str]] = []

    def add(title: str, text: str) -> str:
        passage_id = str(len(passages))
        passages.append({"id": passage_id, "contents": f'"{title}"\n{text}'})
        return passage_id

    countries = [names.word(2, 3) for _ in range(num_countries)]
    city_country: dict[str, str] = {}
    capital: dict[str, str] = {}
    passage_of: dict[str, str] = {}
    for country in countries:
        cities = [names.word(2, 3) for _ in range(cities_per_country)]
        capital[country] = cities[0]
        rivers = [names.word(2, 2) for _ in range(_RIVERS_PER_COUNTRY)]
        for city in cities:
            city_country[city] = country
            founded = rng.randint(900, 1800)
            passage_of[city] = add(
                city,
                f"{city} is a city in {country}, on the banks of the {rng.choice(rivers)} river. "
                f"It was founded in {founded} and is known for its {rng.choice(_INDUSTRIES)} trade.",
            )
        currency = names.word(1, 2).lower()
        passage_of[country] = add(
            country,
            f"{country} is a country whose capital is {capital[country]}. Its currency is the {currency}, "
            f"and its largest river is the {rivers[0]}.",
        )

    all_cities = sorted(city_country)
    people: list[tuple[str, str, int, str]] = []
    second_passage: dict[str, str] = {}
    for _ in range(num_people):
        person = f"{names.word(1, 2)} {names.word(2, 3)}"
        birth_city = rng.choice(all_cities)
        birth_year = rng.randint(1850, 1990)
        profession = rng.choice(_PROFESSIONS)
        people.append((person, birth_city, birth_year, profession))
        passage_of[person] = add(
            person,
            f"{person} (born {birth_year}) is a {profession} who was born in {birth_city}. "
            f"{person.split()[0]} is remembered for work on the {names.word(2, 2).lower()} method.",
        )
        second_passage[person] = add(
            person,
            f"In {birth_year + rng.randint(25, 45)}, {person} received the {rng.choice(_AWARDS)} award for a "
            f"lifetime of work as a {profession}.",
        )

    companies: list[tuple[str, str, str, int]] = []
    for _ in range(num_companies):
        company = f"{names.word(2, 3)} {rng.choice(('Works', 'Industries', 'Group', 'Company', 'Labs'))}"
        founder = rng.choice(people)[0]
        headquarters = rng.choice(all_cities)
        founded = rng.randint(1880, 2015)
        companies.append((company, founder, headquarters, founded))
        passage_of[company] = add(
            company,
            f"{company} is a {rng.choice(_INDUSTRIES)} company founded in {founded} by {founder}. "
            f"Its headquarters are in {headquarters}.",
        )

    birth_city_of = {person: city for person, city, _, _ in people}
    drafts: list[tuple[str, tuple[str, ...], int, tuple[str, ...]]] = []
    for person, birth_city, _, profession in people:
        country = city_country[birth_city]
        drafts.append((f"In which city was {person} born?", (birth_city,), 1, (passage_of[person],)))
        drafts.append((f"What is the profession of {person}?", (profession,), 1, (passage_of[person],)))
        drafts.append(
            (
                f"In which country was {person} born?",
                (country,),
                2,
                (passage_of[person], passage_of[birth_city]),
            )
        )
    for company, founder, headquarters, founded in companies:
        founder_city = birth_city_of[founder]
        drafts.append((f"Who founded {company}?", (founder,), 1, (passage_of[company],)))
        drafts.append((f"In which year was {company} founded?", (str(founded),), 1, (passage_of[company],)))
        drafts.append(
            (
                f"In which city was the founder of {company} born?",
                (founder_city,),
                2,
                (passage_of[company], passage_of[founder]),
            )
        )
        drafts.append(
            (
                f"In which country are the headquarters of {company}?",
                (city_country[headquarters],),
                2,
                (passage_of[company], passage_of[headquarters]),
            )
        )
        drafts.append(
            (
                f"In which country was the founder of {company} born?",
                (city_country[founder_city],),
                3,
                (passage_of[company], passage_of[founder], passage_of[founder_city]),
            )
        )
    for country in countries:
        drafts.append((f"What is the capital of {country}?", (capital[country],), 1, (passage_of[country],)))
    for city in all_cities:
        drafts.append((f"In which country is {city}?", (city_country[city],), 1, (passage_of[city],)))

    order = list(range(len(drafts)))
    rng.shuffle(order)
    num_test = round(len(drafts) * test_fraction)
    test = set(order[:num_test])
    questions = [
        Question(f"mini-{index}", text, answers, hops, "test" if index in test else "train", support)
        for index, (text, answers, hops, support) in enumerate(drafts)
    ]
    return World(passages, questions)


def question_row(question: Question) -> dict[str, object]:
    """A question as a FlashRAG/Search-R1 data row (`id`, `question`, `golden_answers`) plus hops."""
    return {
        "id": question.question_id,
        "question": question.question,
        "golden_answers": list(question.answers),
        "num_hops": question.num_hops,
        "support": list(question.support),
    }


def write(world: World, out: Path) -> None:
    """`corpus.jsonl`, `train.jsonl` and `test.jsonl` of `world` under `out`."""
    write_jsonl(out / "corpus.jsonl", world.passages)
    for split in ("train", "test"):
        write_jsonl(out / f"{split}.jsonl", (question_row(question) for question in world.split(split)))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m asyncrl_agents.tasks.mini_world", description="Write the searchr1-mini world."
    )
    parser.add_argument("--out", type=Path, required=True, help="folder for the three JSONL files")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    world = generate(args.seed)
    write(world, args.out)
    num_train, num_test = len(world.split("train")), len(world.split("test"))
    print(f"{len(world.passages)} passages, {num_train} train and {num_test} test questions in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
