"""Writes the demo's embedded samples (run once; the outputs are committed beside this script).

- ``sample-pages-articles.xml.bz2``: a small MediaWiki XML export in the real dump format (siteinfo, pages,
  revisions, wikitext with infobox templates, links, references, categories, a redirect and a non-article
  page), about an invented country, so that wikiextractor has real markup to strip.
- ``glue/SST-2/{train,dev,test}.tsv``: a small sentiment task in the official SST-2 layout (test unlabelled).

All text is generated here from templates written for this project; the seed makes it reproducible:
    python demo/make_samples.py
"""
from __future__ import annotations

import bz2
import random
from pathlib import Path
from xml.sax.saxutils import escape

HERE = Path(__file__).resolve().parent
SEED = 2021

ONSETS = ["b", "br", "c", "d", "dr", "f", "g", "gr", "h", "k", "l", "m", "n", "p", "r", "s", "st", "t", "tr", "v", "w"]
VOWELS = ["a", "e", "i", "o", "u", "ae", "ia", "ou"]
CODAS = ["", "n", "r", "l", "s", "th", "m", "nd", "rk"]
REGIONS = ["North March", "Lowland Reach", "Eastern Fells", "Salt Coast", "High Moor", "River Vale"]
INDUSTRIES = ["wool weaving", "salt panning", "barley farming", "boat building", "slate quarrying",
              "cheese making", "glass blowing", "timber milling", "fishing", "bell casting"]
BUILDINGS = ["a stone bridge", "a covered market", "a clock tower", "a lighthouse", "a grain mill",
             "a library", "a harbour wall", "a round church", "a town hall", "a music school"]
FESTIVALS = ["a lantern festival", "a spring fair", "a harvest market", "a boat race", "a winter choir"]
DIRECTIONS = ["north", "south", "east", "west", "north-east", "south-west"]
SEASONS = ["spring", "summer", "autumn", "winter"]


def name(rng: random.Random, syllables: int = 2) -> str:
    return "".join(rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS) for _ in range(syllables)).capitalize()


def settlement_article(rng: random.Random, title: str, rivers: list, towns: list) -> str:
    region, river = rng.choice(REGIONS), rng.choice(rivers)
    founded, population = rng.randint(900, 1850), rng.randint(400, 90000)
    industry, other = rng.sample(INDUSTRIES, 2)
    building, festival = rng.choice(BUILDINGS), rng.choice(FESTIVALS)
    neighbour, direction = rng.choice(towns), rng.choice(DIRECTIONS)
    kind = "town" if population < 20000 else "city"
    paragraphs = [
        f"{{{{Infobox settlement\n| name = {title}\n| region = {region}\n| population = {population}\n}}}}",
        f"'''{title}''' is a {kind} in the [[{region}]] of [[Veldmark]], on the banks of the [[{river} River]]. "
        f"It lies {rng.randint(3, 80)} kilometres {direction} of [[{neighbour}]]. At the last census the {kind} "
        f"had a population of {population:,} people.<ref>Veldmark Census Office, {rng.randint(1990, 2020)}.</ref>",
        "== History ==",
        f"{title} was founded in {founded} as a small settlement of {industry} families. "
        f"In {founded + rng.randint(20, 150)} the people of {title} built {building}, which still stands. "
        f"The {kind} grew quickly during the {rng.choice(['long peace', 'river trade years', 'railway age'])}, "
        f"when {other} became the main trade. A great flood of the {river} River in "
        f"{founded + rng.randint(160, 300)} destroyed much of the old quarter.",
        "== Economy ==",
        f"The economy of {title} is based on {industry} and {other}. Many people also work in "
        f"[[{neighbour}]], which is connected to {title} by a {rng.choice(['railway line', 'canal', 'coach road'])}. "
        f"Every {rng.choice(SEASONS)} the {kind} holds {festival} that draws visitors from across the {region}.",
        "== Geography ==",
        f"The {kind} stands at {rng.randint(2, 900)} metres above sea level. The climate is "
        f"{rng.choice(['mild and wet', 'cold and dry', 'windy', 'warm in summer and cold in winter'])}. "
        f"The {river} River flows through the {kind} from the {rng.choice(DIRECTIONS)} to the {rng.choice(DIRECTIONS)}.",
        "== See also ==",
        f"* [[List of towns in Veldmark]]\n* [[{river} River]]",
        f"[[Category:Towns in the {region}]]\n[[Category:Populated places established in {founded}]]",
    ]
    return "\n\n".join(paragraphs)


def river_article(rng: random.Random, river: str, towns: list) -> str:
    length, source = rng.randint(20, 600), rng.choice(REGIONS)
    through = rng.sample(towns, 3)
    return "\n\n".join([
        f"The '''{river} River''' is a river of [[Veldmark]]. It is {length} kilometres long and rises in the "
        f"[[{source}]].<ref name=\"rivers\">''Rivers of Veldmark'', second edition.</ref>",
        "== Course ==",
        f"From its source the {river} flows {rng.choice(DIRECTIONS)} through [[{through[0]}]], [[{through[1]}]] and "
        f"[[{through[2]}]] before it reaches the sea. Its largest tributary is the [[{name(rng)} River]].",
        "== Uses ==",
        f"The river has been used for {rng.choice(['transport', 'fishing', 'mills', 'irrigation'])} since early times. "
        f"A dam built in {rng.randint(1880, 1990)} supplies water to {rng.choice(through)}.",
        "[[Category:Rivers of Veldmark]]",
    ])


def page(title: str, page_id: int, text: str, ns: int = 0, redirect: str = "") -> str:
    redirect_tag = f'    <redirect title="{escape(redirect)}" />\n' if redirect else ""
    return (f"  <page>\n    <title>{escape(title)}</title>\n    <ns>{ns}</ns>\n    <id>{page_id}</id>\n{redirect_tag}"
            f"    <revision>\n      <id>{page_id * 10}</id>\n      <timestamp>2021-04-01T00:00:00Z</timestamp>\n"
            f"      <contributor>\n        <username>DemoEditor</username>\n        <id>1</id>\n      </contributor>\n"
            f"      <model>wikitext</model>\n      <format>text/x-wiki</format>\n"
            f"      <text xml:space=\"preserve\">{escape(text)}</text>\n    </revision>\n  </page>\n")


HEADER = """<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/" xmlns:xsi="http://www.w3.org/2001/XMLSchema-instance" xsi:schemaLocation="http://www.mediawiki.org/xml/export-0.10/ http://www.mediawiki.org/xml/export-0.10.xsd" version="0.10" xml:lang="en">
  <siteinfo>
    <sitename>Demo Encyclopedia</sitename>
    <dbname>demowiki</dbname>
    <base>https://demo.invalid/wiki/Main_Page</base>
    <generator>MediaWiki 1.36.0</generator>
    <case>first-letter</case>
    <namespaces>
      <namespace key="0" case="first-letter" />
      <namespace key="4" case="first-letter">Wikipedia</namespace>
      <namespace key="10" case="first-letter">Template</namespace>
      <namespace key="14" case="first-letter">Category</namespace>
    </namespaces>
  </siteinfo>
"""


def write_wiki_dump(rng: random.Random, path: Path, num_towns: int = 260, num_rivers: int = 40) -> None:
    towns = sorted({name(rng, rng.choice([2, 3])) for _ in range(num_towns)})
    rivers = sorted({name(rng) for _ in range(num_rivers)})
    pages, page_id = [], 1
    for town in towns:
        pages.append(page(town, page_id, settlement_article(rng, town, rivers, towns)))
        page_id += 1
    for river in rivers:
        pages.append(page(f"{river} River", page_id, river_article(rng, river, towns)))
        page_id += 1
    pages.append(page("Veldmark towns", page_id, "#REDIRECT [[List of towns in Veldmark]]", redirect="List of towns in Veldmark"))
    pages.append(page("Wikipedia:About", page_id + 1, "This page is about the project, not an article.", ns=4))
    with bz2.open(path, "wt", encoding="utf-8") as f:
        f.write(HEADER + "".join(pages) + "</mediawiki>\n")


POSITIVE = ["wonderful", "delightful", "charming", "excellent", "friendly", "beautiful", "memorable", "superb"]
NEGATIVE = ["dreadful", "boring", "dirty", "awful", "rude", "disappointing", "noisy", "miserable"]
SUBJECTS = ["the market", "the old bridge", "the harbour", "the museum", "the boat trip", "the festival",
            "the guest house", "the river walk", "the concert", "the food"]
LINKS = ["and", "but honestly", "and frankly", "and overall"]


def review(rng: random.Random, positive: bool) -> str:
    words = POSITIVE if positive else NEGATIVE
    place = name(rng)
    first = f"{rng.choice(SUBJECTS)} in {place} was {rng.choice(words)}"
    second = f"{rng.choice(SUBJECTS)} felt {rng.choice(words)}"
    if rng.random() < 0.3:  # a contrasting clause makes the task less trivial
        second = f"{rng.choice(SUBJECTS)} was {rng.choice(NEGATIVE if positive else POSITIVE)} , yet we left " \
                 f"{'happy' if positive else 'unhappy'}"
    return f"{first} {rng.choice(LINKS)} {second} ."


def write_glue_task(rng: random.Random, folder: Path, sizes=(("train", 600), ("dev", 150), ("test", 150))) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for split, n in sizes:
        rows = []
        for i in range(n):
            label = rng.random() < 0.5
            rows.append((review(rng, label), int(label)))
        with open(folder / f"{split}.tsv", "w") as f:
            if split == "test":
                f.write("index\tsentence\n" + "".join(f"{i}\t{s}\n" for i, (s, _) in enumerate(rows)))
            else:
                f.write("sentence\tlabel\n" + "".join(f"{s}\t{y}\n" for s, y in rows))


if __name__ == "__main__":
    rng = random.Random(SEED)
    write_wiki_dump(rng, HERE / "sample-pages-articles.xml.bz2")
    write_glue_task(rng, HERE / "glue" / "SST-2")
    print(f"wrote {HERE / 'sample-pages-articles.xml.bz2'} and {HERE / 'glue' / 'SST-2'}")
