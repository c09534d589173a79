"""Stage 0's acceptance run (issue 32): a web-like corpus built from text the rules were not tuned on, stage 0 with
its defaults and `languages: [ja]`, and what it removes of each kind.

    PYTHONPATH=src:tests python bench/bench_corpus_acceptance.py --out /tmp/acceptance [--workers 1] [--seed 0]

Needs the Japanese Debian documentation (root: apt-get install --no-install-recommends debian-reference-ja
debian-faq-ja maint-guide-ja developers-reference-ja debian-policy-ja aptitude-doc-ja; without the recommended w3m,
whose Japanese man page would join the tests' man-page corpus), groff and the man pages of other languages under
/usr/share/man/<lang>. The corpus, in one shuffled jsonl (--out/docs.jsonl, its labels in --out/labels.jsonl):
- good Japanese: the sections of those manuals (Debian Reference, the Debian FAQ, the New Maintainers' Guide,
  the Developer's Reference, the Policy Manual, aptitude's manual: their HTML split at the section headings),
  200+ characters, kana at least 5% of the letters (the ground truth is the
  script, not the language model); the Japanese man pages are not used;
- near duplicates: one near copy of each good section of 1,000+ characters (tests/test_corpus_neardup.py's
  near_copy: a random character edit per 300 characters, re-wrapped at 40/60/72 columns, a page header and
  footer); a pair counts as removed when stage 0 keeps at most one of the two;
- other languages: every man page of /usr/share/man/<lang> but ja (de, fr, es, ru, zh_CN, zh_TW, ko, pl, ...),
  formatted with groff as stage 0 does, 200+ characters;
- junk, generated with a fixed seed: Japanese spam (keyword-stuffed ads, affiliate blurbs), navigation menus and
  link lists, dumps (hex, base64, logs, package lists, JSON) and tables (CSV of numbers, Japanese-headed
  statistics).
Prints each kind's count and share removed against the issue's targets, the drops by reason, and writes each
kind's wrongly kept or wrongly dropped documents to --out/misses/<kind>.jsonl for `gptpipe prepare --explain`.
"""

from __future__ import annotations

import argparse
import collections
import html.parser
import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import ClassVar

import yaml

from gptpipe.corpus.config import CorpusConfig
from gptpipe.corpus.language import IDEOGRAPH_WEIGHT

from test_corpus_neardup import MAN, manpage_texts, near_copy

MIN_CHARS = 200  # a section shorter than this is a heading and a line: not a web page
COPY_MIN_CHARS = 1000  # near copies of sections this long (on shorter ones the boilerplate outweighs the edit)
KANA = re.compile(r"[\u3041-\u309f\u30a0-\u30ff]")
JAPANESE = re.compile(r"[\u3041-\u309f\u30a0-\u30ff\u3400-\u4dbf\u4e00-\u9fff]")
LETTER = re.compile(r"[^\W\d_]")
TARGETS = {"near duplicate pairs": 0.90, "other languages": 0.95, "junk": 0.80}

# Each manual's HTML edition (its text and PDF editions are the same text again). The Sphinx manuals' _sources
# are the English originals (the translation lives in .po files): their HTML is read.
MANUALS = ["/usr/share/debian-reference/*.ja.html", "/usr/share/doc/debian/FAQ/ja/*.ja.html",
           "/usr/share/doc/maint-guide-ja/html/*.ja.html", "/usr/share/doc/aptitude/html/ja/*.html",
           "/usr/share/developers-reference/ja/*.html", "/usr/share/doc/debian-policy/ja/policy.html/*.html"]


class HtmlSections(html.parser.HTMLParser):
    """An HTML manual page's text (DocBook's or Sphinx's), one string per section: block elements become lines,
    <pre> keeps its lines, table rows become lines of cells; navigation, tables of contents, sidebars, heading
    anchors, scripts and styles are left out."""

    SKIP_CLASSES: ClassVar[set[str]] = {"toc", "navheader", "navfooter", "list-of-tables", "list-of-figures",
                                        "list-of-examples", "sphinxsidebar", "related", "footer", "headerlink"}
    BLOCKS: ClassVar[set[str]] = {"p", "div", "li", "dt", "dd", "tr", "br", "h1", "h2", "h3", "h4", "h5", "title",
                                  "table", "pre"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.sections: list[list[str]] = [[]]
        self.line: list[str] = []
        self.skipping: str | None = None  # the tag of the skipped element we are in
        self.skip_depth = 0  # its nesting (the same tag inside it)
        self.pre = 0

    def flush(self) -> None:
        text = "".join(self.line)
        self.line = []
        lines = text.split("\n") if self.pre else [" ".join(text.split())]
        self.sections[-1].extend(line.rstrip() for line in lines if line.strip())

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if self.skipping:
            self.skip_depth += tag == self.skipping
            return
        if tag in ("script", "style", "head") or set((dict(attrs).get("class") or "").split()) & self.SKIP_CLASSES:
            self.skipping, self.skip_depth = tag, 1
            return
        if tag in self.BLOCKS:
            self.flush()
        if tag in ("h1", "h2", "h3") and self.sections[-1]:
            self.sections.append([])
        if tag == "pre":
            self.pre += 1
        if tag in ("td", "th"):
            self.line.append(" ")

    def handle_endtag(self, tag: str) -> None:
        if self.skipping:
            self.skip_depth -= tag == self.skipping
            if not self.skip_depth:
                self.skipping = None
            return
        if tag in self.BLOCKS:
            self.flush()
        if tag == "pre":
            self.pre -= 1

    def handle_data(self, data: str) -> None:
        if not self.skipping:
            self.line.append(data)


def html_sections(path: Path) -> list[str]:
    parser = HtmlSections()
    parser.feed(path.read_text(encoding="utf-8", errors="replace"))
    parser.flush()
    return ["\n".join(lines) for lines in parser.sections]


def is_japanese(text: str) -> bool:
    letters = len(LETTER.findall(text))
    return letters > 0 and len(KANA.findall(text)) / letters >= 0.05


def japanese_share(text: str) -> float:
    """How much of the section's text is Japanese, by its script: kana and kanji over the letters, each Japanese
    character counted as the English letters it stands for (IDEOGRAPH_WEIGHT, measured on translations by
    bench/bench_ideograph_weight.py), as stage 0's vote counts it. A section the translators left mostly in
    English (a translated heading and a sentence or two) is low; a Japanese one with commands is not."""
    japanese = len(JAPANESE.findall(text)) * IDEOGRAPH_WEIGHT
    return japanese / max(japanese + len(LETTER.findall(text)) - len(JAPANESE.findall(text)), 1)


def good_japanese() -> list[tuple[str, str]]:
    """(origin, text) of every section of the Japanese manuals, 200+ characters, Japanese by its script."""
    from glob import glob

    found = []
    for pattern in MANUALS:
        for name in sorted(glob(pattern)):
            if Path(name).name in ("search.html", "genindex.html", "index.html", "developers-reference.html"):
                continue  # a search form, an index of links, a table of contents
            for i, text in enumerate(html_sections(Path(name))):
                text = text.strip()
                if len(text) >= MIN_CHARS and is_japanese(text):
                    found.append((f"{name}#{i}", text))
    return found


def other_languages() -> list[tuple[str, str]]:
    found = []
    for folder in sorted(MAN.iterdir()):
        if folder.name == "ja" or folder.name.startswith("man"):
            continue
        found += [(f"man/{folder.name}#{i}", t) for i, t in enumerate(manpage_texts(folder, 1, 10**6, MIN_CHARS))]
    return found


# Junk: what a crawl brings beside the articles. Words from generic web vocabulary, not from any rule's threshold.
SPAM_WORDS = ["激安", "送料無料", "最安値", "ブランド", "財布", "バッグ", "腕時計", "コピー", "通販", "限定", "今だけ",
              "無料", "副業", "高収入", "在宅", "稼げる", "簡単", "即日", "出会い", "ダイエット", "サプリ", "脱毛",
              "口コミ", "ランキング", "人気", "おすすめ", "比較", "格安", "キャンペーン", "ポイント", "還元", "セール",
              "新作", "正規品", "アウトレット", "半額", "クーポン", "登録", "今すぐ", "チェック"]
MENU_ITEMS = ["ホーム", "トップ", "会社概要", "事業内容", "採用情報", "お知らせ", "ニュース", "ブログ", "お問い合わせ",
              "サイトマップ", "プライバシーポリシー", "利用規約", "ログイン", "新規登録", "マイページ", "カート",
              "よくある質問", "ヘルプ", "アクセス", "English", "検索", "カテゴリー", "アーカイブ", "タグ", "前へ",
              "次へ", "ページトップへ", "メニュー", "閉じる", "RSS", "シェア", "ツイート", "いいね", "ランキング",
              "特集", "新着記事", "人気記事", "関連記事", "コメント", "トラックバック"]
TOPICS = ["パソコン", "スマホ", "旅行", "グルメ", "料理", "健康", "美容", "ファッション", "車", "住宅", "転職", "投資",
          "子育て", "ペット", "ゲーム", "アニメ", "映画", "音楽", "スポーツ", "読書"]
PREFECTURES = ["北海道", "青森県", "岩手県", "宮城県", "秋田県", "山形県", "福島県", "茨城県", "栃木県", "群馬県",
               "埼玉県", "千葉県", "東京都", "神奈川県", "新潟県", "富山県", "石川県", "福井県", "山梨県", "長野県",
               "岐阜県", "静岡県", "愛知県", "三重県", "滋賀県", "京都府", "大阪府", "兵庫県", "奈良県", "和歌山県"]


def spam(rng: random.Random) -> str:
    kind = rng.randrange(3)
    if kind == 0:  # keyword stuffing: lines of ad words
        return "\n".join(" ".join(rng.choices(SPAM_WORDS, k=rng.randint(4, 9))) for _ in range(rng.randint(8, 40)))
    if kind == 1:  # the same ad, its item and price changed, many times
        item = rng.choice(SPAM_WORDS[3:7])
        return "\n".join(f"【{rng.choice(SPAM_WORDS)}】{item} {rng.choice(SPAM_WORDS)} {rng.randint(1, 99) * 100}円 "
                         f"{rng.choice(SPAM_WORDS)}！今すぐクリック→ http://example{rng.randint(1, 9)}.jp/?id="
                         f"{rng.randint(1000, 9999)}" for _ in range(rng.randint(10, 50)))
    topic = rng.choice(TOPICS)  # an affiliate blurb: one sentence pattern, words swapped
    return "".join(f"{topic}なら{rng.choice(SPAM_WORDS)}で{rng.choice(SPAM_WORDS)}！{rng.choice(SPAM_WORDS)}の"
                   f"{topic}が{rng.choice(SPAM_WORDS)}。詳しくはこちら。\n" for _ in range(rng.randint(10, 40)))


def menu(rng: random.Random) -> str:
    kind = rng.randrange(3)
    if kind == 0:  # a site's menus, sidebar and footer
        return "\n".join(rng.sample(MENU_ITEMS, rng.randint(12, 30)))
    if kind == 1:  # a category list with counts and a breadcrumb
        crumbs = " > ".join(["ホーム"] + rng.sample(TOPICS, 3))
        counts = [f"{t} ({rng.randint(1, 300)})" for t in rng.sample(TOPICS, rng.randint(10, 20))]
        return crumbs + "\n" + "\n".join(counts)
    # a link list of article titles with dates
    return "\n".join(f"{rng.randint(2015, 2024)}/{rng.randint(1, 12):02d}/{rng.randint(1, 28):02d} "
                     f"【{rng.choice(TOPICS)}】{rng.choice(SPAM_WORDS)}{rng.choice(TOPICS)}{rng.randint(3, 20)}選"
                     for _ in range(rng.randint(10, 40)))


LOG_EVENTS = ["Accepted publickey for", "Connection closed by", "session opened for user",
              "Out of memory: Killed process"]


def dump(rng: random.Random, binary: bytes) -> str:
    kind = rng.randrange(5)
    at = rng.randrange(len(binary) - 4096)
    chunk = binary[at:at + rng.randint(512, 4096)]
    if kind == 0:  # xxd
        return "\n".join(f"{i:08x}: " + " ".join(chunk[j:j + 2].hex() for j in range(i, min(i + 16, len(chunk)), 2))
                         for i in range(0, len(chunk), 16))
    if kind == 1:  # base64
        import base64

        text = base64.b64encode(chunk).decode()
        return "\n".join(text[i:i + 76] for i in range(0, len(text), 76))
    if kind == 2:  # a log
        return "\n".join(f"Nov {rng.randint(1, 30):2d} {rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:"
                         f"{rng.randint(0, 59):02d} host{rng.randint(1, 9)} {rng.choice(['sshd', 'kernel', 'cron'])}"
                         f"[{rng.randint(100, 99999)}]: {rng.choice(LOG_EVENTS)}"
                         f" {rng.randint(1, 255)}.{rng.randint(0, 255)}.{rng.randint(0, 255)}.{rng.randint(0, 255)}"
                         for _ in range(rng.randint(20, 80)))
    if kind == 3:  # a package list
        names = sorted(os.listdir("/usr/share/doc"))
        return "\n".join(f"ii  {n:<40} {rng.randint(0, 9)}.{rng.randint(0, 30)}-{rng.randint(1, 5)}  amd64"
                         for n in rng.sample(names, min(len(names), rng.randint(20, 80))))
    return json.dumps([{"id": rng.randint(1, 10**6), "name": rng.choice(TOPICS), "price": rng.randint(100, 99999),
                        "stock": rng.randint(0, 50), "tags": rng.sample(SPAM_WORDS, 3)}
                       for _ in range(rng.randint(5, 30))], ensure_ascii=False, indent=1)


def table(rng: random.Random) -> str:
    if rng.randrange(2):  # CSV of numbers
        columns = rng.randint(4, 10)
        return "\n".join(",".join(f"{rng.uniform(0, 1000):.{rng.randint(0, 3)}f}" for _ in range(columns))
                         for _ in range(rng.randint(20, 80)))
    year = rng.randint(2000, 2024)  # Japanese-headed statistics
    head = f"都道府県別 {rng.choice(TOPICS)}統計 {year}年\n都道府県\t人口\t面積(km2)\t世帯数\t前年比(%)"
    return head + "\n" + "\n".join(f"{p}\t{rng.randint(500_000, 14_000_000):,}\t{rng.uniform(1000, 80000):.1f}\t"
                                   f"{rng.randint(200_000, 7_000_000):,}\t{rng.uniform(-2, 2):+.2f}"
                                   for p in rng.sample(PREFECTURES, rng.randint(10, 30)))


def junk(rng: random.Random, per_kind: int) -> list[tuple[str, str]]:
    binary = Path(sys.executable).resolve().read_bytes()
    makers = {"spam": spam, "menu": menu, "dump": lambda r: dump(r, binary), "table": table}
    return [(f"junk/{name}#{i}", make(rng)) for name, make in makers.items() for i in range(per_kind)]


def build(seed: int, junk_per_kind: int) -> list[dict]:
    """The labelled documents, shuffled: {kind, origin, text, pair (the other member's index, near pairs only)}."""
    rng = random.Random(seed)
    docs: list[dict] = []
    seen: set[str] = set()

    def add(kind: str, origin: str, text: str) -> int | None:
        text = text.strip()
        if text in seen:  # exact copies inside the manuals (a repeated note): not this test's duplicates
            return None
        seen.add(text)
        docs.append({"kind": kind, "origin": origin, "text": text})
        return len(docs) - 1

    for origin, text in good_japanese():
        original = add("good Japanese", origin, text)
        if original is not None and len(text) >= COPY_MIN_CHARS:
            copy = add("near copy", origin + " (copy)", near_copy(text, "ja", rng))
            if copy is not None:
                docs[original]["pair"], docs[copy]["pair"] = copy, original
    for origin, text in other_languages():
        add("other languages", origin, text)
    for origin, text in junk(rng, junk_per_kind):
        add("junk", origin, text)
    order = list(range(len(docs)))
    rng.shuffle(order)
    where = {old: new for new, old in enumerate(order)}
    shuffled = [docs[i] for i in order]
    for doc in shuffled:
        if "pair" in doc:
            doc["pair"] = where[doc["pair"]]
    return shuffled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the corpus, stage 0's output, misses")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--junk", type=int, default=100, help="junk documents of each kind (spam, menu, dump, table)")
    parser.add_argument("--workers", type=int, default=1, help="corpus.workers (the output is the same for any)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    docs = build(args.seed, args.junk)
    with open(args.out / "docs.jsonl", "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps({"text": d["text"]}, ensure_ascii=False) + "\n" for d in docs)
    with open(args.out / "labels.jsonl", "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps({k: v for k, v in d.items() if k != "text"}, ensure_ascii=False) + "\n"
                      for d in docs)
    mb = (args.out / "docs.jsonl").stat().st_size / 1e6
    print(f"corpus: {len(docs):,} documents, {mb:.1f} MB: "
          + ", ".join(f"{kind} {n:,}" for kind, n in collections.Counter(d["kind"] for d in docs).items()))
    config = {"corpus": {"sources": [{"type": "jsonl", "path": str(args.out / "docs.jsonl")}], "languages": ["ja"],
                         "output_dir": str(args.out / "stage0"), "workers": args.workers}}
    (args.out / "config.yaml").write_text(yaml.safe_dump(config, allow_unicode=True), encoding="utf-8")
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "gptpipe", "prepare", "--config", str(args.out / "config.yaml"), "--force",
                    "corpus.join=true"],
                   check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - started
    with open(args.out / "stage0" / "corpus.jsonl", encoding="utf-8") as fh:
        kept_texts = {json.loads(line)["text"] for line in fh}
    kept = [d["text"] in kept_texts for d in docs]
    manifest = json.loads((args.out / "stage0" / "manifest.json").read_text(encoding="utf-8"))
    print(f"stage 0: {wall:.1f} s, {len(kept_texts):,} kept; drops by reason: "
          + json.dumps(manifest["counts"].get("dropped", {}), ensure_ascii=False))

    misses: dict[str, list[dict]] = collections.defaultdict(list)
    rows = []
    pairs = [(i, d["pair"]) for i, d in enumerate(docs) if d["kind"] == "good Japanese" and "pair" in d]
    resolved = sum(not (kept[i] and kept[j]) for i, j in pairs)
    both_dropped = sum(not kept[i] and not kept[j] for i, j in pairs)
    misses["near duplicate pairs"] = [docs[i] for i, j in pairs if kept[i] and kept[j]]
    rows.append(("near duplicate pairs", len(pairs), resolved, 0.90))
    for kind in ("other languages", "junk"):
        members = [i for i, d in enumerate(docs) if d["kind"] == kind]
        misses[kind] = [docs[i] for i in members if kept[i]]
        rows.append((kind, len(members), len(members) - len(misses[kind]), TARGETS[kind]))
    # Good Japanese lost: a unique section dropped, or a pair of which both are dropped; also by the share of
    # Japanese in the section (the translations leave some sections mostly in English).
    unique = [i for i, d in enumerate(docs) if d["kind"] == "good Japanese" and "pair" not in d]
    lost = [i for i in unique if not kept[i]] + [i for i, j in pairs if not kept[i] and not kept[j]]
    misses["good Japanese lost"] = [docs[i] for i in lost]
    print("\n| kind | documents | removed | share | target |\n| --- | --- | --- | --- | --- |")
    for kind, total, removed, target in rows:
        print(f"| {kind} | {total:,} | {removed:,} | {removed / max(total, 1):.1%} | >= {target:.0%} |")
    # The target's "good Japanese documents": sections whose text is at least corpus.language_min_share Japanese
    # by their script (the user's own definition of a document to keep). The others are the translations'
    # English under a Japanese heading or sentence: either verdict is right for them, so they are counted apart.
    good = unique + [i for i, _ in pairs]
    share = {i: japanese_share(docs[i]["text"]) for i in good}
    enough = CorpusConfig().language_min_share
    japanese = [i for i in good if share[i] >= enough]
    gone = [i for i in lost if share[i] >= enough]
    print(f"| good Japanese: Japanese >= {enough:g} of the text | {len(japanese):,} | {len(gone):,} lost | "
          f"{len(gone) / max(len(japanese), 1):.2%} | <= 1% |")
    print(f"| mostly English sections (Japanese under {enough:g}) | {len(good) - len(japanese):,} | "
          f"{len(lost) - len(gone):,} dropped | | |")
    print(f"| all sections with kana (unique + pairs) | {len(good):,} | {len(lost):,} lost | "
          f"{len(lost) / max(len(good), 1):.2%} | |")
    for low, high in ((0.0, 0.2), (0.2, enough), (enough, 0.5), (0.5, 1.01)):
        group = [i for i in good if low <= share[i] < high]
        gone = [i for i in lost if low <= share[i] < high]
        print(f"| ... Japanese {low:g}-{min(high, 1):g} of the text | {len(group):,} | {len(gone):,} lost | "
              f"{len(gone) / max(len(group), 1):.2%} | |")
    print(f"pairs both dropped: {both_dropped}; lost, by reason: see --explain on misses/good_Japanese_lost.jsonl")
    by_origin = collections.Counter(d["origin"].split("#")[0] for d in misses["junk"])
    if by_origin:
        print("junk kept, by maker: " + ", ".join(f"{k} {n}" for k, n in by_origin.most_common()))
    other = collections.Counter(d["origin"].split("#")[0] for d in misses["other languages"])
    if other:
        print("other languages kept: " + ", ".join(f"{k} {n}" for k, n in other.most_common()))
    (args.out / "misses").mkdir(exist_ok=True)
    for kind, found in misses.items():
        with open(args.out / "misses" / f"{kind.replace(' ', '_')}.jsonl", "w", encoding="utf-8") as fh:
            fh.writelines(json.dumps({"origin": d["origin"], "text": d["text"]}, ensure_ascii=False) + "\n"
                          for d in found)


if __name__ == "__main__":
    main()
